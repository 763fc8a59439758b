"""What the default model (SmolLM2-135M-Instruct) does well, greedy and short: facts, a line of
verse, a list cut by a stop string. Expected output: examples/expected/chat_basics.txt (a test)."""
import justfit

rt = justfit.Runtime()  # the default model, fetched and converted on first use

# A plain question: one user message, greedy decoding.
print(rt.generate("What is the capital of France?", max_tokens=24).text)

# Creative text loops on a model this small unless repeats are penalised (`justfit chat` defaults to 1.1).
print(rt.generate("Write a haiku about memory.", max_tokens=48, repetition_penalty=1.1).text)

# A stop string ends the reply before it (finish_reason "stop"); here: after the third item.
g = rt.generate("List three fruits, one per line, numbered.", max_tokens=48, stop=["4."])
print(g.text.strip())
print("finish:", g.stats.finish_reason, "| generated tokens:", g.stats.generated_tokens)
