#!/usr/bin/env bash
# The client libraries the scripts in benchmarks/clients/ drive, in a venv of their own (.peers/clients,
# gitignored) so they never touch sobrio's runtime dependencies: the official `openai` client,
# LangChain's `langchain-openai` and Simon Willison's `llm`. No torch; about 30 s from the package index.
#   benchmarks/clients/setup.sh            (then benchmarks/clients/run_all.sh)
# Nothing here downloads at run time: langchain-openai's tiktoken is only asked for token counts, which
# the scripts turn off (OpenAIEmbeddings(check_embedding_ctx_length=False, tiktoken_enabled=False)).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .peers/clients/bin/python ] || python3 -m venv .peers/clients
.peers/clients/bin/pip install -q --disable-pip-version-check openai langchain-openai llm
.peers/clients/bin/python -c "import openai, langchain_openai, llm; print('clients:', 'openai', openai.__version__, \
'| langchain-openai', __import__('importlib.metadata').metadata.version('langchain-openai'), '| llm', \
__import__('importlib.metadata').metadata.version('llm'))"
