"""Evaluation: speculative decoding and what it is measured with.

    decode     the decode loop: draft, verify, accept (greedy or the speculative sampling rule)
    kernels    the few-row matrix kernels decoding runs the target with on a CPU
    bench      tau and wall-clock speedup per benchmark, paired against plain decoding
    calibrate  the cost of a round at every k on this machine, and the k it predicts best
    stats      paired differences and bootstrap intervals
    machine    other work on the machine while a timing runs
    report     the written report (tables, figures)
    check      a served draft folder checked as the engines load it
"""
