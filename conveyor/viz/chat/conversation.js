// The conversation as the browser keeps it: the turns, the chosen model and the sampling settings, saved in
// localStorage (this origin's, so one server's page never reads another's) so that a reload finds them again.
// The API key is never saved here: it stays in the page's address, as the dashboard's does.

const STORE_KEY = "conveyor.chat";

class Conversation {
  constructor() {
    this.messages = [];  // {role: "user" | "assistant", content, reasoning?, model?, note?, failed?}
    this.model = null;
    this.settings = { maxTokens: "", temperature: "" };
    this.load();
  }

  load() {
    let saved = null;
    try { saved = JSON.parse(localStorage.getItem(STORE_KEY) || "null"); } catch (error) { saved = null; }
    if (!saved || !Array.isArray(saved.messages)) return;
    this.messages = saved.messages.filter((m) => m && (m.role === "user" || m.role === "assistant"));
    this.model = typeof saved.model === "string" ? saved.model : null;
    this.settings = { ...this.settings, ...(saved.settings || {}) };
  }

  save() {
    const state = { messages: this.messages, model: this.model, settings: this.settings };
    try { localStorage.setItem(STORE_KEY, JSON.stringify(state)); } catch (error) { /* full or off: kept in memory */ }
  }

  clear() { this.messages = []; this.save(); }

  lastUserIndex() {
    for (let i = this.messages.length - 1; i >= 0; i--) if (this.messages[i].role === "user") return i;
    return -1;
  }

  // What the server is sent: the turns up to the last user one, as OpenAI's messages (the reasoning of earlier
  // answers stays here, as chat templates drop it anyway; an answer that failed before any text is left out).
  request() {
    const last = this.lastUserIndex();
    return this.messages.slice(0, last + 1).filter((m) => m.role === "user" || m.content)
      .map((m) => ({ role: m.role, content: m.content }));
  }

  // Regenerate: drop every answer after the last user turn, so that the next answer replaces them.
  dropLastAnswer() {
    this.messages.length = this.lastUserIndex() + 1;
  }

  // The request's sampling fields: those the user set, the server's defaults for the rest.
  sampling() {
    const fields = {};
    const maxTokens = parseInt(this.settings.maxTokens, 10), temperature = parseFloat(this.settings.temperature);
    if (Number.isFinite(maxTokens)) fields.max_tokens = maxTokens;
    if (Number.isFinite(temperature)) fields.temperature = temperature;
    return fields;
  }
}
