// Server-sent events from a fetch body: each "data:" event parsed as JSON, until [DONE] or the body ends.
async function readEvents(body, onEvent) {
  const reader = body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data === "[DONE]") return;
        if (data) onEvent(JSON.parse(data));
      }
    }
  } finally {
    reader.cancel().catch(() => {});  // a failed or finished stream lets its connection go
  }
}
