"""Sub-agent fan-out: three sub-agents run as one batch (their turns decoded together by the runtime's
batching engine) from the same fork point of a files agent; none of them prefills the shared prompt
again, and their results return to the parent."""
import sys
import tempfile
from pathlib import Path

import justfit
from justfit_agents.ready import files_agent

root = Path(tempfile.mkdtemp())
(root / "alpha.txt").write_text("Alpha ships on Monday.\n")
(root / "beta.txt").write_text("Beta ships on Friday.\n")
(root / "gamma.txt").write_text("Gamma is cancelled.\n")

# What a 135M model does reliably: one call with the arguments spelled out in the task (here a file
# name). It does not reliably chain calls or summarize, so each agent makes one forced call and its
# tool's result is what it found.
agent = files_agent(justfit.Runtime(), root, tool_choice={"name": "list_dir"}, max_steps=1)
listing = agent.run("List the files.").tool_calls[0]
print(f"parent: {listing.name}() -> {', '.join(listing.result.split())}")
names = ("alpha.txt", "beta.txt", "gamma.txt")
tasks = [f"Open {name} and tell me what it says." for name in names]
results = agent.fan_out(tasks, tool_choice={"name": "read_file"}, max_steps=1)
wrong = 0
for name, r in zip(names, results):
    st, call = r.steps[0].stats, r.tool_calls[0]
    print(f"sub-agent {name}: reused {st.reused_tokens} / prefilled {st.prefilled_tokens} tokens -> "
          f"{call.name}({call.arguments}) -> {call.result.strip()!r}")
    wrong += call.result != (root / name).read_text()
if wrong:
    sys.exit(f"{wrong} sub-agent(s) read the wrong file")
