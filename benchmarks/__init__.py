"""The benchmark driver, its worker and workloads; the meters and the job launcher they use live in
lightning_gpipe.tools (meter, launch)."""
