"""`python -m xmem.trace`: the tracing child (see xmem.trace.child.main)."""

from xmem.trace.child.main import main

main()
