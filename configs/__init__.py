"""YAML presets (package data): SM partitioning per op, per GPU x TP size. Loaded by overlap.config.schema."""

__project__ = "tp-overlap"  # checked by overlap/_install.py
