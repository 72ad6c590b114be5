"""`snakemake --executor submitit`: every job goes to SLURM through submitit, and a job that hits its
time limit (or is preempted) requeues itself and resumes. Snakemake finds this plugin by its name."""

from dataclasses import dataclass, field
from typing import Optional

from snakemake_interface_executor_plugins.settings import CommonSettings, ExecutorSettingsBase

from snakemake_executor_plugin_submitit import config_errors
from snakemake_executor_plugin_submitit.executor import Executor

# Snakemake imports this module before it reads --configfile: a YAML error then names its position.
config_errors.install()

__all__ = ["Executor", "ExecutorSettings", "common_settings"]


@dataclass
class ExecutorSettings(ExecutorSettingsBase):
    folder: Optional[str] = field(default=None, metadata={
        "help": "Folder for submitit's job scripts, pickles and logs, on a file system the nodes share. "
                "Default: a fresh .snakemake/submitit/<date>-<time>-<pid> per Snakemake run (SLURM job ids "
                "restart when a cluster's state is wiped, so folders are never reused)."})
    partition: Optional[str] = field(default=None, metadata={
        "help": "Default partition of every job (a job's slurm_partition resource wins).", "env_var": True})
    account: Optional[str] = field(default=None, metadata={
        "help": "Default account of every job (a job's slurm_account resource wins).", "env_var": True})
    qos: Optional[str] = field(default=None, metadata={
        "help": "Default quality of service of every job (a job's slurm_qos resource wins).", "env_var": True})
    array_parallelism: int = field(default=64, metadata={
        "help": "Ready jobs with the same resources go out as one job array; at most this many of its "
                "tasks run at once."})
    max_timeouts: int = field(default=3, metadata={
        "help": "How many times a job that reached its time limit is requeued (preemptions do not count)."})
    signal_delay: int = field(default=90, metadata={
        "help": "Seconds before its time limit that a job is told to stop, save its state and requeue."})
    sbatch: Optional[str] = field(default=None, metadata={
        "help": "Extra sbatch parameters for every job, as KEY=VALUE pairs separated by commas, for example "
                "'exclusive=,mail-type=END' (a KEY= without a value is a flag)."})


common_settings = CommonSettings(
    non_local_exec=True,
    implies_no_shared_fs=False,   # SLURM clusters share the file system with the submit host
    job_deploy_sources=False,
    pass_default_storage_provider_args=True,
    pass_default_resources_args=True,
    pass_envvar_declarations_to_cmd=False,  # sbatch exports the environment by default
    auto_deploy_default_storage_provider=False,
    init_seconds_before_status_checks=1,
)
