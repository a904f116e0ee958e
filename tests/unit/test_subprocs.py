"""A child that exits before it reads its input (llmgw_slurm/base/subprocs.py): its exit
status and stderr reach the caller, on asyncio's loop and on uvloop's."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from llmgw_slurm.base.subprocs import communicate


async def _gone_before_its_input(size: int) -> tuple[int | None, bytes, bytes]:
    proc = await asyncio.create_subprocess_exec(
        "sh",
        "-c",
        "echo refused >&2; exit 3",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    # The child exits, closing its end of the pipe, before anything is written.
    await proc.wait()
    out, err = await communicate(proc, b"x" * size)
    return proc.returncode, out, err


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("size", [16, 1 << 20])
def test_a_child_gone_before_its_input_gives_its_status_not_an_error(
    loop: str, size: int
) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        assert runner.run(_gone_before_its_input(size)) == (3, b"", b"refused\n")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_input_reaches_a_child_that_writes_as_it_reads(loop: str) -> None:
    # 8 MiB through cat: far more than the pipes and the output reader hold,
    # so the input must be fed while the output is read (a bound, not a
    # timing: a deadlock would otherwise hang the test run).
    data = b"a" * (8 << 20)

    async def main() -> tuple[bytes, bytes]:
        proc = await asyncio.create_subprocess_exec(
            "cat", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            return await asyncio.wait_for(communicate(proc, data), 120)
        finally:
            if proc.returncode is None:
                proc.kill()
                # communicate, not wait: a paused output pipe never ends otherwise.
                await proc.communicate()

    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        out, err = runner.run(main())
    assert (len(out), out == data, err) == (len(data), True, b"")
