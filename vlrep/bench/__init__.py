"""vlrep's own speed and reliability measurements: the train-step benchmark (benchmark, with its PyTorch baseline
torch_reference), the input pipeline (pipeline_benchmark), the VOC07 SVM solvers (svm_benchmark), the
fault-injection harness (faults) and the data-at-scale test (scale_test), each a command-line program; and
device_turns, the schedule by which benchmark processes share one accelerator. docs/speed.md, docs/reliability.md
and docs/data_at_scale.md show their commands and results. The tools a researcher runs on their own runs and data
are in vlrep.tools, which imports nothing from here."""
