from tetrad.cli import main

main()
