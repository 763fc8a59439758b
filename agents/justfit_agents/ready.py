"""Ready agents: `files` answers questions about a folder, `coding` writes and runs Python there."""

from typing import Optional

from .agent import Agent
from .sandbox import Workspace

FILES_SYSTEM = ("You answer questions about the files in a local folder. First look at the folder with "
                "list_dir, read the files that matter with read_file or search_files, then give a short answer "
                "that names the file it came from.")
CODING_SYSTEM = ("You are a careful Python programmer working in a folder. Write the code to a .py file with "
                 "write_file, run it with run_python (for example: exec(open('main.py').read())), read the "
                 "output, fix errors, and answer with what the program printed.")


def files_agent(runtime, workspace, session: Optional[str] = None, **kw) -> Agent:
    """A read-only agent over `workspace` (list_dir, read_file, search_files)."""
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace)
    kw.setdefault("tool_choice", "required")
    return Agent(runtime, system=FILES_SYSTEM, tools=ws.tools(files=True), session=session, **kw)


def coding_agent(runtime, workspace, session: Optional[str] = None, shell_allow=None, unsafe_no_sandbox=False,
                 **kw) -> Agent:
    """An agent that writes files and runs Python (and allowed shell commands) in `workspace`, inside the
    OS sandbox (SandboxError when there is none, unless unsafe_no_sandbox=True)."""
    ws = workspace if isinstance(workspace, Workspace) else Workspace(workspace, shell_allow=shell_allow,
                                                                      unsafe_no_sandbox=unsafe_no_sandbox)
    kw.setdefault("tool_choice", "required")
    kw.setdefault("max_string", 800)
    tools = ws.tools(files=True, write=True, python=True, shell=bool(ws.shell_allow))
    return Agent(runtime, system=CODING_SYSTEM, tools=tools, session=session, **kw)


READY = {"files": files_agent, "coding": coding_agent}
