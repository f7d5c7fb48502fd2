from extproc.server import main

main()
