"""Agent frameworks as their users run them, against the server's app on the default model (in process): the OpenAI
Agents SDK (an Agent with one function tool) and LangChain (`ChatOpenAI.bind_tools`), each completing
a tool round trip. SmolLM2-135M is weak, so the call is forced with tool_choice (the grammar makes it
valid); what is tested is the wire protocol each framework speaks."""

import pytest



def test_openai_agents_sdk_function_tool(server):
    agents = pytest.importorskip("agents", reason="pip install openai-agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300,
                         http_client=server.async_client())
    agent = agents.Agent(
        name="weather", instructions="Answer weather questions with the tool.", tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model="default", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=40),
        tool_use_behavior="stop_on_first_tool")
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(calls) == 1 and calls[0].strip()
    assert result.final_output == f"18 C and sunny in {calls[0]}"


def test_langchain_chatopenai_bind_tools_round_trip(server):
    pytest.importorskip("langchain_openai", reason="pip install langchain-openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_time(city: str) -> str:
        """Local time in a city."""
        return "14:05"

    llm = ChatOpenAI(model="default", base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=40,
                     max_retries=0, timeout=300, http_client=server.http)
    msgs = [HumanMessage("What time is it in Tokyo?")]
    ai = llm.bind_tools([get_time], tool_choice="get_time").invoke(msgs)
    assert [c["name"] for c in ai.tool_calls] == ["get_time"] and isinstance(ai.tool_calls[0]["args"]["city"], str)
    msgs += [ai, ToolMessage(get_time.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([get_time], tool_choice="none").invoke(msgs)
    assert final.content and not final.tool_calls and not final.content.lstrip().startswith("<tool_call>")
    assert final.usage_metadata["input_token_details"]["cache_read"] > 0  # the first turn's prompt was reused
