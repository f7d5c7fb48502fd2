from enginesim.server import main

main()
