"""The memory planner (``posttrain plan``) and the model shapes it and the benchmarks use."""
