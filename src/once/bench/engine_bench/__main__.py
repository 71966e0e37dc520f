from once.bench.engine_bench.cli import main

raise SystemExit(main())
