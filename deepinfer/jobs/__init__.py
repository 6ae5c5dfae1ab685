"""Offline jobs: run a program over a JSON-lines file (`deepinfer run FILE.py:FUNC ...`)."""

from deepinfer.jobs.errors import JobUsageError
from deepinfer.jobs.program import load_program, program_signature
from deepinfer.jobs.runner import JobOptions, JobSummary, run_job, validate_options

__all__ = ["JobOptions", "JobSummary", "JobUsageError", "load_program", "program_signature", "run_job",
           "validate_options"]
