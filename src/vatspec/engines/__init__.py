"""Serving engines measured from outside: launched (``launch``), loaded (``load``), their counters read
(``metrics``), runs interleaved and compared (``bench``), reported (``report``); ``vatspec serve-bench``."""
