from enginesim.cli import main

main()
