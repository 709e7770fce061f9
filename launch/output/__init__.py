"""What the entry points of `launch/` write: one results format (`report`: JSON with provenance plus rows,
and a markdown table), the plots (`plots`, `offload_plot`, `results_plots`) and the tables of
results/README.md (`results_tables`)."""
