from eva_fastclip.cli import main

raise SystemExit(main())
