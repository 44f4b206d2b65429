"""Capturing a runner's keys: the capture loop and its report (``loop``), the advice per failure cause
(``advice``), the output-layout probe (``probe``) and the lazily captured graph cache (``lazy``).
"""
