from server.app import main

main()
