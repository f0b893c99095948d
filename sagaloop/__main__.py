from sagaloop.cli.main import main

main()
