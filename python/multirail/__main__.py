from multirail.cli import main

raise SystemExit(main())
