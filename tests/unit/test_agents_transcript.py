"""A transcript never shows a run that gave no answer as if it had one."""

from justfit_agents.agent import Result, Step, ToolCall


def test_transcript_last_line_says_whether_there_is_an_answer():
    call = ToolCall("read_file", {"path": "a"}, "error: SandboxError: no file 'a'")
    repeated = Result(call.result, [Step(0, "", call), Step(1, "", call)], "repeat").transcript().splitlines()[-1]
    assert repeated.startswith("=== no final answer (stopped: repeat)") and "error:" in repeated
    done = Result("42", [Step(0, "", ToolCall("final_answer", {"answer": "42"}, "42"))], "answer")
    assert done.transcript().splitlines()[-1] == "=== answer: 42"
