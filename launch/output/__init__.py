"""What the entry points of `launch/` write: one results format (`report`: JSON with provenance plus rows,
and a markdown table), the plots (`plots`, `offload_plot`, `record_plots`; `results_plots` draws a results
folder's), the reading of a step's Chrome trace (`trace_lanes`) and the numbers of results/README.md
(`results_tables`). The lowest part of `launch/`: it imports no other."""
