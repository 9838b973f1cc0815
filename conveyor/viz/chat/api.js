// The page's calls to its server: the API key (from ?api_key=, or typed in when a call was refused) sent as
// Authorization: Bearer; every refusal turned into words for the user; a streamed chat answer read from its
// server-sent events with fetch, so that an AbortController can stop it (the server then aborts the request).

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

const api = {
  key: new URLSearchParams(location.search).get("api_key") || "",

  // A key typed in goes into the address (not into storage), so that a reload and the dashboard link keep it.
  setKey(key) {
    this.key = key;
    const url = new URL(location.href);
    if (key) url.searchParams.set("api_key", key); else url.searchParams.delete("api_key");
    history.replaceState(null, "", url);
  },

  headers() {
    const headers = { "Content-Type": "application/json" };
    if (this.key) headers.Authorization = `Bearer ${this.key}`;
    return headers;
  },

  async call(path, options = {}) {
    let response;
    try {
      response = await fetch(path, { ...options, headers: this.headers(), cache: "no-store" });
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ApiError(0, `Cannot reach the server (${error.message}). Is it still running?`);
    }
    if (!response.ok) throw new ApiError(response.status, describeRefusal(response.status, await errorMessage(response)));
    return response;
  },

  async models() {
    return (await (await this.call("/v1/models")).json()).data;
  },

  // Stream one chat answer: onDelta(delta) for each choice delta, onUsage(usage) for the last chunk's usage.
  // Resolves with the finish reason; rejects with an ApiError (in words) or, when stopped, an AbortError.
  async streamChat(body, signal, onDelta, onUsage) {
    const response = await this.call("/v1/chat/completions", {
      method: "POST", signal,
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    });
    let finish = null;
    await readEvents(response.body, (chunk) => {
      if (chunk.error) throw new ApiError(500, `The answer failed on the server: ${chunk.error.message}`);
      if (chunk.usage) onUsage(chunk.usage);
      for (const choice of chunk.choices || []) {
        if (choice.delta) onDelta(choice.delta);
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
    return finish;
  },
};

async function errorMessage(response) {
  const text = await response.text();
  try { return JSON.parse(text).error.message || text; } catch (error) { return text; }
}

function describeRefusal(status, message) {
  const said = message ? `: ${message}` : "";
  const words = {
    400: "The server refused the request",
    401: "The server wants its API key, and this page has none or a wrong one; enter it below",
    404: "The server has no such model or route",
    413: "The conversation is too long for the server to take in one request",
    429: "The server is busy; try again in a moment",
    503: "The server cannot answer now (overloaded, or its engine stopped); try again shortly",
  }[status] || "The server could not answer";
  return `${words} (HTTP ${status})${said}`;
}
