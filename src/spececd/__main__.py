from spececd.cli import main

raise SystemExit(main())
