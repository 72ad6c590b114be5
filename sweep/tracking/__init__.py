"""Tracking: the study in MLflow, a view of the run directories that can always be rebuilt. One experiment
and parent run per study, syncs and live followers (experiment), one run's sync (run_sync), what has been
synced, kept beside each run (sync_records), experiment tags set by several processes at once
(concurrent_tags) and the study's landing page in the UI (study_page)."""
