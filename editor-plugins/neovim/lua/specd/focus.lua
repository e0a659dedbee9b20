--- specd/didFocus: tells specd-lsp where the cursor came to rest (a buffer entered or just
--- attached, a jump in normal mode, insert mode entered), so that the daemon prefills the prompt a
--- completion there needs while the user reads, and the first keystroke's suggestion does not
--- wait for it. Debounced per buffer; sent once per (buffer, line): a move along the line keeps
--- most of that prompt. Not on CursorMovedI: while the user types, the edits tell the daemon where.

local util = require('specd.util')

local M = {}

M.METHOD = 'specd/didFocus'
M.DEBOUNCE_MS = 100 -- a run of jumps (search, scrolling) sends only where it stopped

local EVENTS = { 'BufEnter', 'CursorMoved', 'InsertEnter' }

local timers = {} ---@type table<integer, uv.uv_timer_t> per buffer
local sent_line = {} ---@type table<integer, integer> per buffer, the 0-based line last sent

--- Sends the hint for the cursor in `bufnr` now, if it is the current buffer, specd is attached
--- to it, and the cursor's line is not the one last sent for it.
---@param bufnr integer
function M.send(bufnr)
  if bufnr ~= vim.api.nvim_get_current_buf() then
    return -- the buffer entered since schedules its own
  end
  local client = util.clients(bufnr)[1]
  if not client or util.is_stopped(client) then
    return
  end
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  if sent_line[bufnr] == params.position.line then
    return
  end
  sent_line[bufnr] = params.position.line
  util.notify(client, M.METHOD, { textDocument = params.textDocument, position = params.position })
end

--- Sends the hint for `bufnr` once its cursor has been still for DEBOUNCE_MS.
---@param bufnr integer
function M.schedule(bufnr)
  local timer = timers[bufnr]
  if not timer then
    timer = assert(vim.uv.new_timer())
    timers[bufnr] = timer
  end
  timer:stop()
  timer:start(M.DEBOUNCE_MS, 0, vim.schedule_wrap(function()
    M.send(bufnr)
  end))
end

--- Starts the hints for a buffer specd just attached to (its BufEnter came before the attach).
---@param bufnr integer
---@param group integer the buffer's augroup
function M.watch(bufnr, group)
  vim.api.nvim_create_autocmd(EVENTS, {
    group = group,
    buffer = bufnr,
    callback = function()
      M.schedule(bufnr)
    end,
  })
  if bufnr == vim.api.nvim_get_current_buf() then
    M.schedule(bufnr)
  end
end

---@param bufnr integer
function M.forget(bufnr)
  local timer = timers[bufnr]
  if timer then
    timer:stop()
    timer:close()
  end
  timers[bufnr], sent_line[bufnr] = nil, nil
end

return M
