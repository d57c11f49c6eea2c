"""torchrun workers that run qlm against itself (launched as scripts by conftest.run_worker_jobs / launch_torchrun;
imported by their pytest modules for the case lists)."""
