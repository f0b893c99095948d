"""A tiny MCP server over stdio, for the SagaAgent MCP tests (tests/unit/test_agents_mcp.py).

``python mcp_server.py LEDGER``: the tool ``refund`` appends one line to the file ``LEDGER`` (read
by the test from outside the engine, to count the effects) and answers with a refund id.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

server = MCPServer("payments")
ledger = Path(sys.argv[1])


@server.tool()
def refund(order: str, amount: int) -> str:
    """Refund ``amount`` cents of order ``order``; returns the refund's id."""
    with ledger.open("a") as f:
        f.write(f"refund {order} {amount}\n")
    return f"rf-{order}-{amount}"


if __name__ == "__main__":
    server.run("stdio")
