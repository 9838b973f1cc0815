// The page's controls: the model picker (every model /v1/models lists), sending a turn and drawing its answer as
// it streams (reasoning apart from the answer), stop, regenerate, a new chat, the sampling settings, the API
// key form and the link to the dashboard of the chosen model. Text is only ever set as text, never as markup.

const $ = (id) => document.getElementById(id);
const conversation = new Conversation();
const ui = { controller: null };  // the AbortController of the answer streaming now, if one is

function setNotice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

function showError(error) {
  setNotice(error.message);
  if (error.status === 401) { $("key-form").hidden = false; $("api-key").focus(); }
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text) node.textContent = text;
  return node;
}

function messageView(message) {
  const item = element("li", `message ${message.role}`);
  const reasoning = element("details", "reasoning");
  reasoning.open = true;
  reasoning.append(element("summary", "", "reasoning"), element("div", "text"));
  const role = message.role === "user" ? "you" : message.model || "assistant";
  item.append(element("div", "role", role), reasoning, element("div", "content"), element("div", "meta"));
  fillView(item, message);
  return item;
}

function fillView(item, message) {
  const reasoning = item.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  reasoning.querySelector(".text").textContent = message.reasoning || "";
  item.querySelector(".content").textContent = message.content;
  const meta = item.querySelector(".meta");
  meta.textContent = message.note || "";
  meta.classList.toggle("bad", Boolean(message.failed));
}

function render() {
  $("messages").replaceChildren(...conversation.messages.map(messageView));
  $("empty").hidden = conversation.messages.length > 0;
  updateControls();
}

function updateControls() {
  const busy = ui.controller !== null;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || conversation.lastUserIndex() < 0;
  $("status").textContent = busy ? "answering…" : "";
}

function follow() {  // keep the newest text in view, unless the reader scrolled up
  const main = document.querySelector("main");
  if (main.scrollHeight - main.scrollTop - main.clientHeight < 80) main.scrollTop = main.scrollHeight;
}

function linkDashboard() {
  const query = new URLSearchParams();
  if (conversation.model) query.set("model", conversation.model);
  if (api.key) query.set("api_key", api.key);
  const text = query.toString();
  $("dashboard-link").href = text ? `/dashboard?${text}` : "/dashboard";
}

async function loadModels() {
  let cards;
  try {
    cards = await api.models();
  } catch (error) {
    showError(error);
    return false;
  }
  const options = cards.map((card) => {
    const option = element("option", "", card.loaded === false ? `${card.id} (loads on first use)` : card.id);
    option.value = card.id;
    return option;
  });
  $("model").replaceChildren(...options);
  if (!cards.some((card) => card.id === conversation.model)) conversation.model = cards.length ? cards[0].id : null;
  $("model").value = conversation.model;
  $("key-form").hidden = true;
  setNotice("");
  linkDashboard();
  return true;
}

function finishNote(finish, usage) {
  const tokens = usage ? `${usage.completion_tokens} tokens` : "";
  const why = { length: "reached max tokens", stop: "", tool_calls: "tool calls" }[finish] ?? (finish || "");
  return [tokens, why].filter(Boolean).join(", ");
}

// Ask for an answer to the conversation as it stands (it ends with a user turn), drawing it as it arrives.
async function answer() {
  if (!conversation.model && !(await loadModels())) return;
  setNotice("");
  const body = { model: conversation.model, messages: conversation.request(), ...conversation.sampling() };
  const message = { role: "assistant", content: "", reasoning: "", model: conversation.model, note: "" };
  conversation.messages.push(message);
  render();
  const item = $("messages").lastElementChild;
  const controller = new AbortController();
  ui.controller = controller;
  updateControls();
  let usage = null;
  try {
    const finish = await api.streamChat(body, controller.signal, (delta) => {
      if (delta.reasoning_content) message.reasoning += delta.reasoning_content;
      if (delta.content) message.content += delta.content;
      fillView(item, message);
      follow();
    }, (given) => { usage = given; });
    message.note = finishNote(finish, usage);
  } catch (error) {
    if (error.name === "AbortError") {
      message.note = "stopped";
    } else {
      message.failed = true;
      message.note = "failed (see below)";
      showError(error);
    }
  } finally {
    if (ui.controller === controller) ui.controller = null;
    const index = conversation.messages.indexOf(message);
    if (message.failed && !message.content && !message.reasoning && index >= 0) conversation.messages.splice(index, 1);
    conversation.save();
    render();
  }
}

function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || ui.controller) return;
  conversation.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  conversation.save();
  answer();
}

function wireControls() {
  $("composer").onsubmit = send;
  $("prompt").onkeydown = (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) { event.preventDefault(); $("composer").requestSubmit(); }
  };
  $("stop").onclick = () => { if (ui.controller) ui.controller.abort(); };
  $("regenerate").onclick = () => {
    if (ui.controller || conversation.lastUserIndex() < 0) return;
    conversation.dropLastAnswer();
    answer();
  };
  $("new-chat").onclick = () => {
    if (ui.controller) ui.controller.abort();
    conversation.clear();
    setNotice("");
    render();
  };
  $("model").onchange = () => { conversation.model = $("model").value; conversation.save(); linkDashboard(); };
  for (const [id, setting] of [["max-tokens", "maxTokens"], ["temperature", "temperature"]]) {
    $(id).value = conversation.settings[setting];
    $(id).oninput = () => { conversation.settings[setting] = $(id).value; conversation.save(); };
  }
  $("key-form").onsubmit = (event) => {
    event.preventDefault();
    api.setKey($("api-key").value.trim());
    $("api-key").value = "";
    loadModels();
  };
}

wireControls();
render();
linkDashboard();
loadModels();
