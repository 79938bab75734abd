"""Two tools in OpenAI's shape, for the tool-call tests over gRPC (tests/orchestrator/test_tool_calls.py)
and HTTP (test_http.py)."""

from __future__ import annotations

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Lisbon", "Paris"]},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = (WEATHER, TIME)
