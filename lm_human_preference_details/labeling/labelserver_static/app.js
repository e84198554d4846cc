// Labeling page. Model text is untrusted: it only ever reaches the page through textContent.
"use strict";

const state = { labeler: null, info: null, current: null, busy: false, poll: null };

// A labeler's name is bound to a labeler key at its first use: the server gives it once, the page keeps it per name
// and sends it with every request for that name.
function storedKeys() {
  try {
    return JSON.parse(localStorage.getItem("labelerKeys") || "{}");
  } catch {
    return {};
  }
}

function foldName(name) {
  // what the server does to a name (NFKC, case folded, spaces collapsed), closely enough to find its key
  return name.normalize("NFKC").toLowerCase().normalize("NFKC").split(/\s+/).filter(Boolean).join(" ");
}

function keyOf(name) {
  return storedKeys()[foldName(name)];
}

function saveKey(name, key) {
  const keys = storedKeys();
  keys[foldName(name)] = key;
  localStorage.setItem("labelerKeys", JSON.stringify(keys));
}

// The access token, when the server needs one, is an HttpOnly cookie set by the server's redirect from the ?token= URL:
// this script never sees it, and the URL that carried it never rendered a page.
async function call(method, path, body) {
  const options = { method, headers: {}, credentials: "same-origin" };
  if (body !== undefined) {
    options.headers["Content-Type"] = "application/json";
    options.body = JSON.stringify(body.labeler === undefined ? body : { ...body, key: keyOf(body.labeler) });
  }
  const response = await fetch(path, options);
  const data = await response.json().catch(() => ({}));
  if (data.labeler_key) {
    saveKey(data.labeler || (data.next && data.next.labeler) || body.labeler, data.labeler_key);
  }
  if (!response.ok) {
    const error = new Error(data.error || `request failed (${response.status})`);
    error.status = response.status;
    throw error;
  }
  return data;
}

function $(id) {
  return document.getElementById(id);
}

function setStatus(message, isError) {
  const status = $("status");
  status.textContent = message;
  status.classList.toggle("error", Boolean(isError));
}

function keyHelp(info) {
  if (info.kind === "best") {
    return `Keys: 1-${info.num_samples} pick the best response, S skip, U undo.`;
  }
  if (info.kind === "score") {
    return `Keys: ${info.scale[0]}-${info.scale[1]} rate the response (${info.scale[0]} bad, ${info.scale[1]} good), S skip, U undo.`;
  }
  return "Keys: 1 response A much better, 2 A better, 3 equal, 4 B better, 5 B much better; S skip, U undo.";
}

function scaleChoices(info) {
  if (info.kind === "score") {
    const choices = [];
    for (let value = info.scale[0]; value <= info.scale[1]; value++) {
      choices.push({ key: String(value), answer: value, label: String(value) });
    }
    return choices;
  }
  const labels = ["A much better", "A better", "equal", "B better", "B much better"];
  return labels.map((label, i) => ({ key: String(i + 1), answer: i - 2, label }));
}

function doneMessage(progress) {
  const every = `checking again every ${state.info.poll_seconds} s`;
  if (progress.claimed_by_others > 0) {
    const rows = progress.claimed_by_others === 1 ? "1 row is" : `${progress.claimed_by_others} rows are`;
    return `No row is free for you right now: ${rows} being labelled by others and may come back; ${every}.`;
  }
  return `All rows are done for you. Thank you! (${every} in case a row comes back.)`;
}

function schedulePoll(wanted) {
  clearTimeout(state.poll);
  state.poll = wanted ? setTimeout(refresh, state.info.poll_seconds * 1000) : null;
}

function render(next) {
  state.current = next;
  state.labeler = next.labeler;
  localStorage.setItem("labeler", next.labeler);
  $("who").textContent = `labeler: ${next.labeler}`;
  $("key").textContent = keyOf(next.labeler) || "";
  const progress = next.progress;
  const rate = progress.per_minute === null ? "–" : progress.per_minute.toFixed(1);
  $("progress").textContent =
    `${progress.labelled} labelled, ${progress.skipped} skipped, ${progress.remaining} left for you ` +
    `(${progress.total} rows) · ${rate} labels/min over the last 10 minutes`;
  $("undo").disabled = !progress.can_undo;
  $("export-error").hidden = !next.export_error;
  $("export-error").textContent = next.export_error ? `Your labels are saved, but ${next.export_error}; it is tried again every few seconds.` : "";
  $("workspace").hidden = false;
  const done = next.row === null;
  $("labeling").hidden = done;
  $("done").hidden = !done;
  $("skip").disabled = done;
  schedulePoll(done);
  if (done) {
    $("done").textContent = doneMessage(progress);
    document.body.dataset.row = "done";
    return;
  }
  $("query").textContent = next.query;
  const list = $("responses");
  list.replaceChildren();
  next.responses.forEach((text, position) => {
    const item = document.createElement("li");
    const clickable = state.info.kind === "best";
    const box = document.createElement(clickable ? "button" : "div");
    box.className = "response";
    if (clickable) {
      box.type = "button";
      box.addEventListener("click", () => submit(position));
    }
    const key = document.createElement("span");
    key.className = "key";
    key.textContent = state.info.kind === "difference" ? (position === 0 ? "A" : "B") : String(position + 1);
    const body = document.createElement("div");
    body.className = "text";
    body.textContent = text;
    box.append(key, body);
    item.append(box);
    list.append(item);
  });
  document.body.dataset.row = String(next.row);
}

async function refresh() {
  if (!state.labeler || state.busy) {
    schedulePoll(state.current && state.current.row === null);
    return;
  }
  try {
    render(await call("POST", "/api/next", { labeler: state.labeler }));
  } catch (error) {
    setStatus(error.message, true);
    schedulePoll(true);
  }
}

async function act(request) {
  if (state.busy) {
    return;
  }
  state.busy = true;
  try {
    const result = await request();
    render(result.next);
    return result;
  } catch (error) {
    if (error.status === 409) {
      // another tab or window of this labeler moved on: show where the labeler is now instead of sticking
      state.busy = false;
      await refresh();
      setStatus(`${error.message} (done in another tab or window?) Showing your next row.`, true);
      return;
    }
    setStatus(error.message, true);
  } finally {
    state.busy = false;
  }
}

async function submit(answer) {
  const row = state.current && state.current.row;
  if (row === null || row === undefined) {
    return;
  }
  const result = await act(() => call("POST", "/api/judge", { labeler: state.labeler, row, answer }));
  if (result) {
    setStatus(`saved row ${row}`);
    document.body.dataset.saved = String(result.saved);
  }
}

async function skip() {
  const row = state.current && state.current.row;
  if (row !== null && row !== undefined && (await act(() => call("POST", "/api/skip", { labeler: state.labeler, row })))) {
    setStatus(`skipped row ${row}`);
  }
}

async function undo() {
  const result = await act(() => call("POST", "/api/undo", { labeler: state.labeler }));
  if (result) {
    setStatus(`undid row ${result.undone}`);
  }
}

function onKey(event) {
  if (!state.labeler || event.target.tagName === "INPUT" || event.ctrlKey || event.metaKey || event.altKey) {
    return;
  }
  const key = event.key.toLowerCase();
  if (key === "s") {
    skip();
  } else if (key === "u") {
    undo();
  } else if (state.info.kind === "best") {
    const position = Number(key) - 1;
    if (Number.isInteger(position) && position >= 0 && position < state.info.num_samples) {
      submit(position);
    }
  } else {
    const choice = scaleChoices(state.info).find((c) => c.key === key);
    if (choice) {
      submit(choice.answer);
    }
  }
}

async function start(name) {
  $("login").hidden = true;
  if (document.activeElement) {
    document.activeElement.blur(); // the keys now label rows, not type a name
  }
  try {
    render(await call("POST", "/api/next", { labeler: name }));
    setStatus("");
  } catch (error) {
    showLogin();
    setStatus(error.message, true);
  }
}

function showLogin() {
  state.labeler = null;
  state.current = null;
  schedulePoll(false);
  $("workspace").hidden = true;
  $("login").hidden = false;
  $("who").textContent = "";
  $("name").focus();
}

async function main() {
  try {
    state.info = await call("GET", "/api/info");
  } catch (error) {
    setStatus(error.message, true);
    return;
  }
  $("instructions").textContent = state.info.instructions || "Pick the best response.";
  $("keys").textContent = keyHelp(state.info);
  $("responses-title").textContent =
    state.info.kind === "best" ? "Responses: pick the best" : state.info.kind === "score" ? "Response" : "Responses";
  if (state.info.kind !== "best") {
    for (const choice of scaleChoices(state.info)) {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = `${choice.key}: ${choice.label}`;
      button.addEventListener("click", () => submit(choice.answer));
      $("scale").append(button);
    }
  }
  $("login").addEventListener("submit", (event) => {
    event.preventDefault();
    const name = $("name").value.trim();
    const key = $("key-input").value.trim();
    if (name && key) {
      saveKey(name, key);
      $("key-input").value = "";
    }
    if (name) {
      start(name);
    }
  });
  $("skip").addEventListener("click", skip);
  $("undo").addEventListener("click", undo);
  $("rename").addEventListener("click", showLogin);
  document.addEventListener("keydown", onKey);
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible") {
      refresh(); // another tab of this labeler may have moved on meanwhile
    }
  });
  const saved = localStorage.getItem("labeler");
  if (saved) {
    start(saved);
  } else {
    showLogin();
  }
}

main();
