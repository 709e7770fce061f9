"""What every entry point of `launch/` shares at its edges: argument parsing, one-line errors and run folders
(`common`), the process group (`dist`), the benchmark shape table the arguments choose from (`shapes`), and
the checks of a run's arguments against memory and placement made before any process group or GPU allocation
(`limits`, `kfactor_args`, `tp_mlp_plan`). It imports `launch.output` at most, never `launch.measure`."""
