from fedswarm.cli import main

main()
