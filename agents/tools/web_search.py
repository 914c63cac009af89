"""Web search tool over an HTTP search API, for users who have a key: the Tavily API shape.

    POST {api_base}/search    Authorization: Bearer <key>
    {"query": "...", "max_results": 3, "search_depth": "basic"}
 -> {"query": "...", "results": [{"title": "...", "url": "...", "content": "...", "score": 0.9}, ...]}

Any server that speaks this shape works (`api_base`): Tavily itself, a self-hosted proxy, or the local server
the tests run. The key is read from the environment variable `api_key_env` (never from the graph file, so graphs
can be shared); it is sent only to `api_base` and never written to a trace or an error. A failed request (HTTP
error, bad JSON, no answer within the tool's `timeout_s`) fails that step with the reason, as every tool does.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator

from masgraph.agents.tools.registry import ToolError, ToolOptions, register_kind

__all__ = ["WebSearchOptions", "format_results"]


class WebSearchOptions(ToolOptions):
    api_base: str = "https://api.tavily.com"
    """Base URL of the search API (the request goes to `{api_base}/search`)."""
    api_key_env: str = Field("TAVILY_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The environment variable that holds the API key (the key itself never goes into the graph file)."""
    top_k: int = Field(3, ge=1, le=20)
    """Results returned per query (`max_results`)."""
    snippet_chars: int | None = Field(500, ge=20, le=100_000)
    """Cut each result's text to this many characters (None: whole)."""
    search_depth: Literal["basic", "advanced"] = "basic"
    """The provider's search depth."""

    @field_validator("api_base")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"api_base {v!r} is not an http:// or https:// URL")
        return v.rstrip("/")


def format_results(body: Any, top_k: int, cut: int | None) -> str:
    """The results of a response body as the tool's text: `[title] content (url)` per line; a ToolError when the
    body is not the expected shape."""
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list):
        raise ToolError("web search answered without a `results` list")
    lines = []
    for r in results[:top_k]:
        if not isinstance(r, dict):
            continue
        text = str(r.get("content") or "")
        if cut is not None and len(text) > cut:
            text = text[:cut].rstrip() + "…"
        lines.append(f"[{r.get('title') or r.get('url') or 'result'}] {text}" + (f" ({r['url']})" if r.get("url")
                                                                                else ""))
    return "\n".join(lines) or "no results"


@register_kind("web_search", "searches the web and returns the best matching pages' text, e.g. Input: capital of "
                             "Australia", options=WebSearchOptions)
def make_web_search(options: WebSearchOptions):
    import httpx

    url = f"{options.api_base}/search"

    async def web_search(query: str) -> str:
        key = os.environ.get(options.api_key_env)
        if not key:
            raise ToolError(f"web search needs an API key: set the environment variable {options.api_key_env}")
        payload = {"query": query, "max_results": options.top_k, "search_depth": options.search_depth}
        try:
            async with httpx.AsyncClient(timeout=None) as client:  # the tool's timeout_s bounds the call
                resp = await client.post(url, json=payload, headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError as exc:
            raise ToolError(f"web search request to {url} failed: {type(exc).__name__}") from None
        if resp.status_code != 200:
            raise ToolError(f"web search at {url} answered HTTP {resp.status_code}: {_reason(resp)}")
        try:
            body = resp.json()
        except ValueError:
            raise ToolError(f"web search at {url} answered something that is not JSON") from None
        return format_results(body, options.top_k, options.snippet_chars)
    return web_search


def _reason(resp: Any) -> str:
    """The error message a provider sent (`detail` / `error` / `message`), shortened; never the request."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200] or resp.reason_phrase
    if isinstance(body, dict):
        for key in ("detail", "error", "message"):
            if body.get(key):
                value = body[key]
                return str(value.get("error", value) if isinstance(value, dict) else value)[:200]
    return str(body)[:200]
