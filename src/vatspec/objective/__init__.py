"""The training objective: what VAT changes.

    verify   simulated verification: accept bits and the first rejection per chain
    terms    per-position weights (the drafter's curve, restarted at the first rejection)
    losses   soft and hard CE, the accept head's BCE and the other objectives (``loss.kind``)
    chunked  the same loss in vocabulary chunks at large vocabularies
    metrics  what a training step reports (acceptance, tau)
"""
