from meshrun.cli import main

raise SystemExit(main())
