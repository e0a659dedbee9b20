--- Loaded into each child Neovim as _G.probe: small readers of the child's state for the tests.

local probe = {}

probe.SOURCE = {
  'def fibonacci(n):',
  '    """Return the n-th Fibonacci number."""',
  '    if n < 2:',
  '        return n',
  '    return fibonacci(n - 1) + fibonacci(n - 2)',
  '',
  '',
  'def main():',
  '    ',
  '',
}
probe.ROW = 9 -- 1-based; the cursor goes to the end of this line (after its four spaces)

--- setup() with the test's options, then open `path` (a Python file holding SOURCE).
function probe.open(path, opts)
  require('specd').setup(opts)
  vim.cmd.edit(vim.fn.fnameescape(path))
end

function probe.ready()
  local status = require('specd').status()
  return status ~= nil and status.state == 'ready'
end

function probe.buffer()
  return table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, false), '\n')
end

function probe.reset_buffer()
  vim.api.nvim_buf_set_lines(0, 0, -1, false, probe.SOURCE)
end

function probe.mode()
  return vim.api.nvim_get_mode().mode
end

local HINTS = { ComplHintMore = true, SpecdGhostHint = true }

--- The ghost text on screen, lines joined with "\n"; nil when none is shown.
function probe.ghost()
  local renderer = require('specd').renderer() == 'native' and 'specd.native' or 'specd.ghost'
  local ns = vim.api.nvim_get_namespaces()[require(renderer).namespace]
  if not ns then
    return nil
  end
  local marks = vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, { details = true })
  if #marks == 0 then
    return nil
  end
  local details = marks[1][4]
  local function join(chunks)
    local parts = {}
    for _, chunk in ipairs(chunks or {}) do
      if not HINTS[chunk[2]] then
        parts[#parts + 1] = chunk[1]
      end
    end
    return table.concat(parts)
  end
  local lines = { join(details.virt_text) }
  for _, line in ipairs(details.virt_lines or {}) do
    lines[#lines + 1] = join(line)
  end
  return table.concat(lines, '\n')
end

--- The hint drawn after the ghost text, e.g. " (2/3)"; nil when none.
function probe.hint()
  local renderer = require('specd').renderer() == 'native' and 'specd.native' or 'specd.ghost'
  local ns = vim.api.nvim_get_namespaces()[require(renderer).namespace]
  for _, mark in ipairs(ns and vim.api.nvim_buf_get_extmarks(0, ns, 0, -1, { details = true }) or {}) do
    local chunks = vim.list_extend(vim.deepcopy(mark[4].virt_text or {}), vim.iter(mark[4].virt_lines or {}):flatten():totable())
    for _, chunk in ipairs(chunks) do
      if type(chunk) == 'table' and HINTS[chunk[2]] then
        return chunk[1]
      end
    end
  end
  return nil
end

--- Records the inline-completion requests the specd client sends: probe.requested[uri] = count,
--- probe.requested_at = the hrtime (ns) of each, in order, probe.requested_versions = the
--- document version each was asked at (the answer's ctx.version).
function probe.record_requests()
  probe.requested, probe.requested_at, probe.requested_versions = {}, {}, {}
  local client = vim.lsp.get_clients({ name = 'specd' })[1]
  local request = client.request
  client.request = function(self, method, params, ...)
    if method == 'textDocument/inlineCompletion' then
      local uri = params.textDocument.uri
      probe.requested[uri] = (probe.requested[uri] or 0) + 1
      probe.requested_at[#probe.requested_at + 1] = vim.uv.hrtime()
      probe.requested_versions[#probe.requested_versions + 1] = vim.lsp.util.buf_versions[vim.uri_to_bufnr(uri)]
    end
    return request(self, method, params, ...)
  end
end

--- Records the specd/didFocus notifications the specd client sends: probe.focused = { {uri, line,
--- character}, ... } in order; probe.focus_runs counts the debounced sends that ran (sent or not).
function probe.record_focus()
  probe.focused, probe.focus_runs = {}, 0
  local focus = require('specd.focus')
  local send = focus.send
  focus.send = function(...)
    probe.focus_runs = probe.focus_runs + 1
    return send(...)
  end
  local client = vim.lsp.get_clients({ name = 'specd' })[1]
  local notify = client.notify
  client.notify = function(...) -- client:notify(method, params) on 0.11+, client.notify(method, params) on 0.10
    local method, params = ...
    if type(method) ~= 'string' then
      method, params = select(2, ...)
    end
    if method == focus.METHOD then
      probe.focused[#probe.focused + 1] = { params.textDocument.uri, params.position.line, params.position.character }
    end
    return notify(...)
  end
end

--- What specd-lsp answers at the cursor right now (its type-through cache answers a repeat).
function probe.server_item()
  local client = vim.lsp.get_clients({ name = 'specd', bufnr = 0 })[1]
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  params.context = { triggerKind = 2 }
  local method, timeout_ms = 'textDocument/inlineCompletion', 10000
  local answer
  if vim.fn.has('nvim-0.11') == 1 then
    answer = client:request_sync(method, params, timeout_ms, 0)
  else
    answer = client.request_sync(method, params, timeout_ms, 0)
  end
  local result = answer and answer.result
  local items = result and (result.items or result) or {}
  local cursor = vim.api.nvim_win_get_cursor(0)
  return { item = items[1], cursor = { cursor[1] - 1, cursor[2] } }
end

--- The buffer-local insert-mode mapping of `lhs`, or nil.
function probe.imap(lhs)
  local map = vim.fn.maparg(lhs, 'i', false, true)
  return map.buffer == 1 and map.desc or nil
end

--- :checkhealth specd's report, as lines.
function probe.checkhealth()
  vim.cmd.checkhealth('specd')
  return vim.api.nvim_buf_get_lines(0, 0, -1, false)
end

return probe
