"""Exports and what reads them: load an export, check that a CLIP fits a DALLE, and the one
generate -> decode -> rerank -> keep pipeline that generate.py and the evaluation share. Imports neither
training nor distributed."""
