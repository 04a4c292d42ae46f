"""`python -m xmem.trace`: the tracing child (see xmem.trace.child)."""

from xmem.trace.child import main

main()
