from xmem.cli import main

main()
