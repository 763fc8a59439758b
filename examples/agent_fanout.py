"""Sub-agent fan-out: three sub-agents run as one batch (their turns decoded together by the runtime's
batching engine) from the same fork point of a files agent; none of them prefills the shared prompt
again, and their answers return to the parent."""
import tempfile
from pathlib import Path

import justfit
from justfit_agents.ready import files_agent

root = Path(tempfile.mkdtemp())
(root / "alpha.txt").write_text("Alpha ships on Monday.\n")
(root / "beta.txt").write_text("Beta ships on Friday.\n")
(root / "gamma.txt").write_text("Gamma is cancelled.\n")

agent = files_agent(justfit.Runtime(), root, max_steps=2)
print(agent.run("List the files.").transcript())
results = agent.fan_out([f"What does {name} say?" for name in ("alpha.txt", "beta.txt", "gamma.txt")])
for r in results:
    st = r.steps[0].stats
    print(f"sub-agent: reused {st.reused_tokens} / prefilled {st.prefilled_tokens} tokens -> {r.answer!r}")
print(agent.run("Summarize what the sub-agents found.").transcript())
