"""Configuration: the validated, frozen dataclasses (`schema`; activation offload's `OffloadConfig`: `offload`),
the YAML presets and their one loader (`presets`), and the one module that reads environment variables
(`envs`)."""
