"""The Executor: submit through submitit, watch SLURM's job states, cancel on Ctrl-C."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import AsyncGenerator, List

import submitit
from snakemake_interface_common.exceptions import WorkflowError
from snakemake_interface_executor_plugins.executors.base import SubmittedJobInfo
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor
from snakemake_interface_executor_plugins.jobs import JobExecutorInterface

from snakemake_executor_plugin_submitit import adopt, requeue
from snakemake_executor_plugin_submitit.command import JobCommand
from snakemake_executor_plugin_submitit.launch import submitit_python
from snakemake_executor_plugin_submitit.resources import command_step, signature, slurm_parameters
from snakemake_executor_plugin_submitit.sacct_watch import SacctWatch

# SLURM states (sacct) of a job that is over, and whether it succeeded.
SUCCESS = {"COMPLETED"}
FAILURE = {"FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "REVOKED",
           "SPECIAL_EXIT"}


def parse_sbatch(text: str | None) -> dict[str, str]:
    """'exclusive=,mail-type=END' -> {'exclusive': '', 'mail_type': 'END'} (submitit's spelling)."""
    extra = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise WorkflowError(f"--submitit-sbatch {item!r}: expected KEY=VALUE (KEY= for a flag)")
        extra[key.strip().lstrip("-").replace("-", "_")] = value.strip()
    return extra


class Executor(RemoteExecutor):
    def __post_init__(self) -> None:
        settings = self.workflow.executor_settings
        folder = settings.folder or Path(".snakemake") / "submitit" / time.strftime(f"%Y%m%d-%H%M%S-{os.getpid()}")
        self.folder = Path(folder).absolute()
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            # launch.py holds SLURM's time-limit warning back until submitit's handler can take it
            self.submitit = submitit.SlurmExecutor(folder=self.folder, max_num_timeout=settings.max_timeouts,
                                                   python=submitit_python())
        except RuntimeError as error:  # no srun on this host
            raise WorkflowError(f"submitit executor: {error}") from None
        self.defaults = {"partition": settings.partition, "account": settings.account, "qos": settings.qos}
        self.extra = parse_sbatch(settings.sbatch)
        self.settings = settings
        self.logger.info(f"submitit: job scripts and logs in {self.folder}")
        self.adoptable = adopt.still_running(self.folder.parent)  # an earlier run's jobs that SLURM still runs
        # Every job this run submitted or followed and has not seen end, for Ctrl-C: Snakemake takes its active
        # jobs out of its own list while a status check runs, so a Ctrl-C then would cancel none of them.
        self.unfinished: dict[str, submitit.SlurmJob] = {}
        self.sacct = SacctWatch.attach()  # submitit only logs sacct's failures at its own logger
        self.requeued: set[str] = set()  # jobs SLURM requeued after their node failed (said once each)

    # --- submission ----------------------------------------------------------------------------

    def run_jobs(self, jobs: List[JobExecutorInterface]) -> None:
        """Ready jobs of the same rule with the same resources go out together, as one job array."""
        groups: dict[tuple, tuple[dict, list[JobExecutorInterface]]] = {}
        for job in jobs:
            self.run_job_pre(job)
            if self._adopted(job):
                continue
            params = self._parameters(job)
            groups.setdefault((job.name, signature(params)), (params, []))[1].append(job)
        for params, members in groups.values():
            self._submit(members, params)

    def run_job(self, job: JobExecutorInterface) -> None:
        if not self._adopted(job):
            self._submit([job], self._parameters(job))

    def _adopted(self, job: JobExecutorInterface) -> bool:
        """Follow the job an earlier run of this study submitted for the same rule and wildcards, if SLURM still
        runs it."""
        found = self.adoptable.pop(adopt.key(job), None)
        if found is None:
            return False
        folder, job_id = found
        handle = submitit.SlurmJob(folder=folder, job_id=job_id)
        self.logger.info(f"SLURM job {job_id} ({job.name}) of an earlier run of this study still runs: "
                         "followed, not submitted again")
        adopt.record(self.folder, [(job_id, folder, adopt.key(job))])
        self.unfinished[job_id] = handle
        self.report_job_submission(SubmittedJobInfo(job, external_jobid=job_id, aux={"submitit": handle}))
        return True

    def _parameters(self, job: JobExecutorInterface) -> dict:
        return slurm_parameters(job.resources, job.threads, self.defaults)

    def _submit(self, jobs: List[JobExecutorInterface], params: dict) -> None:
        """Submit jobs that share `params`: one job, or one job array."""
        # submitit keeps the parameters of earlier updates: the last group's nodes or GPUs must not stay
        self.submitit.parameters.clear()
        self.submitit.update_parameters(
            job_name=f"smk-{jobs[0].name}", signal_delay_s=self.settings.signal_delay,
            array_parallelism=self.settings.array_parallelism, additional_parameters=dict(self.extra), **params,
            **command_step(params))
        grace = max(10.0, self.settings.signal_delay - 20.0)
        commands = [JobCommand(self.format_job_exec(job), grace) for job in jobs]
        try:
            if len(commands) == 1:
                submitted = [self.submitit.submit(commands[0])]
            else:
                with self.submitit.batch():
                    submitted = [self.submitit.submit(command) for command in commands]
        except Exception as error:  # sbatch refused: bad partition, account, resources...
            raise WorkflowError(f"submitit could not submit {len(jobs)} {jobs[0].name} job(s): {error}") from None
        pairs = list(zip(jobs, submitted, strict=True))
        adopt.record(self.folder, [(handle.job_id, self.folder, adopt.key(job)) for job, handle in pairs])
        for job, handle in pairs:
            self.unfinished[handle.job_id] = handle
            self.report_job_submission(SubmittedJobInfo(job, external_jobid=handle.job_id, aux={"submitit": handle}))

    # --- status ----------------------------------------------------------------------------------

    async def check_active_jobs(self, active_jobs: List[SubmittedJobInfo]) -> AsyncGenerator[SubmittedJobInfo, None]:
        if not active_jobs:
            return
        async with self.status_rate_limiter:
            submitit.SlurmJob.watcher.update()  # one sacct call for every job of this run
        said = self.sacct.after_update(time.monotonic(), len(active_jobs))
        if said:
            level, message = said
            getattr(self.logger, level)(message)
        for info in active_jobs:
            handle: submitit.SlurmJob = info.aux["submitit"]
            state = (handle.get_info(mode="cache").get("State") or "UNKNOWN").split()[0].upper()
            if state in requeue.AFTER_NODE_FAILURE and (held := requeue.requeued(handle.job_id)):
                if handle.job_id not in self.requeued:
                    self.requeued.add(handle.job_id)
                    self.logger.info(f"SLURM job {handle.job_id} ({info.job.name}): its node failed, and SLURM "
                                     f"holds it again ({held}): followed; requeued, it runs again (a training "
                                     "job from its last checkpoint)")
                yield info
                continue
            if state in SUCCESS | FAILURE:
                self.unfinished.pop(handle.job_id, None)
            if state in SUCCESS:
                self.report_job_success(info)
            elif state in FAILURE:
                self.report_job_error(info, msg=self._failure_message(handle, state),
                                      aux_logs=[str(handle.paths.stderr)])
            else:  # PENDING, RUNNING, REQUEUED, COMPLETING, PREEMPTED, UNKNOWN (not in sacct yet)
                yield info

    def _failure_message(self, handle: submitit.SlurmJob, state: str) -> str:
        reason = ""
        if state == "TIMEOUT":
            reason = f" (time limit reached, requeued at most {self.settings.max_timeouts} times)"
        return (f"SLURM job {handle.job_id} ended {state}{reason}. Its log: {handle.paths.stderr} "
                f"(stdout: {handle.paths.stdout}). ")

    # --- cancel ------------------------------------------------------------------------------------

    def cancel_jobs(self, active_jobs: List[SubmittedJobInfo]) -> None:
        """Ctrl-C: scancel every job of this run that is still queued or running: those Snakemake lists as
        active and those it has taken out of its list for a status check (self.unfinished)."""
        handles = {**self.unfinished, **{info.aux["submitit"].job_id: info.aux["submitit"] for info in active_jobs}}
        for handle in handles.values():
            handle.cancel(check=False)
