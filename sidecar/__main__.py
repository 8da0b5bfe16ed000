from sidecar.cli._app import main

main()
