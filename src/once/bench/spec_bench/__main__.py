from once.bench.spec_bench.cli import main

raise SystemExit(main())
