"""What a run tells the person watching it, and what it measures of itself.

    reporting.py      setup lines, loss / lr / throughput windows, evaluation results
    runlog.py         train.log, metrics.csv, curves.png, the progress bar
    evaluate.py       evaluation targets during training: .bin verification, re-ID, synthetic pairs
    phases.py         PhaseClock: where a step's time goes, by named phase
    profile.py        --profile: step times by phase, traffic, written to profile/rank<R>.json
    memory_phases.py  --profile: peak memory after each phase of a run (build, resume, saves, steps)
"""
