"""The hub: what a study needs from the Hugging Face hub (hub_needs), fetched on the submitting node before
any job (fetch; a fetch_model job's resources: fetch_job), and every compute job's offline environment
(job_env)."""
