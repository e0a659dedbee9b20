--- The 'plugin' renderer, for Neovim 0.10 and 0.11 (and 0.12 by choice): asks specd-lsp for
--- textDocument/inlineCompletion while you type in insert mode and draws the first item as
--- ghost text with extmarks (inline virtual text, then virtual lines).

local accept = require('specd.accept')
local text = require('specd.text')
local util = require('specd.util')

local M = {}

local ns = vim.api.nvim_create_namespace('specd.ghost')
M.namespace = 'specd.ghost'

local TRIGGER_INVOKED = 1
local TRIGGER_AUTOMATIC = 2

---@class specd.GhostState
---@field client_id integer
---@field items specd.Item[]
---@field index integer
---@field request_id? integer
---@field timer? uv.uv_timer_t
---@field enabled boolean

---@type table<integer, specd.GhostState>
local buffers = {}

local debounce_ms = 0 -- typing pause before asking; setup() sets it from the config

---@param config specd.Config
function M.setup(config)
  debounce_ms = config.debounce_ms
end

---@param bufnr integer
function M.hide(bufnr)
  vim.api.nvim_buf_clear_namespace(bufnr, ns, 0, -1)
end

---@param bufnr integer
---@return boolean
function M.visible(bufnr)
  return vim.api.nvim_buf_is_valid(bufnr) and #vim.api.nvim_buf_get_extmarks(bufnr, ns, 0, -1, { limit = 1 }) > 0
end

---@param state specd.GhostState
local function cancel(state)
  if state.timer then
    state.timer:stop()
    state.timer:close()
    state.timer = nil
  end
  local client = state.request_id and vim.lsp.get_client_by_id(state.client_id)
  if client then
    util.cancel(client, state.request_id)
  end
  state.request_id = nil
end

---@param bufnr integer
local function render(bufnr)
  M.hide(bufnr)
  local state = buffers[bufnr]
  local item = state and state.items[state.index]
  if not item or not util.in_insert_mode(vim.api.nvim_get_mode().mode) then
    return
  end
  local row, col = util.cursor(bufnr)
  local rest = text.remaining(item, bufnr, row, col)
  if not rest or rest == '' then
    return
  end
  local lines = vim.split(rest, '\n', { plain = true })
  -- An item that replaces closers after the cursor (`)`, `")`) carries them at its end; the
  -- buffer's own closers then stand in for them on a one-line suggestion.
  if #lines == 1 and item.end_row == row and item.end_col > col then
    local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ''
    local replaced = line:sub(col + 1, item.end_col)
    if lines[1]:sub(-#replaced) == replaced then
      lines[1] = lines[1]:sub(1, #lines[1] - #replaced)
    end
  end
  local first = { { lines[1], 'SpecdGhost' } }
  if #state.items > 1 then
    table.insert(first, { (' (%d/%d)'):format(state.index, #state.items), 'SpecdGhostHint' })
  end
  local virt_lines = {}
  for i = 2, #lines do
    virt_lines[#virt_lines + 1] = { { lines[i], 'SpecdGhost' } }
  end
  vim.api.nvim_buf_set_extmark(bufnr, ns, row, col, {
    virt_text = first,
    virt_text_pos = 'inline',
    virt_lines = #virt_lines > 0 and virt_lines or nil,
    hl_mode = 'combine',
  })
end

---@param bufnr integer
---@param client vim.lsp.Client
---@param result lsp.InlineCompletionList|lsp.InlineCompletionItem[]|nil
---@return specd.Item[]
local function normalize(bufnr, client, result)
  local items = {}
  local row, col = util.cursor(bufnr)
  for _, raw in ipairs(result and (result.items or result) or {}) do
    local insert = raw.insertText
    local item = {
      text = type(insert) == 'string' and insert or insert.value,
      start_row = row, start_col = col, end_row = row, end_col = col,
      command = raw.command,
      client_id = client.id,
    }
    if raw.range then
      local s, e = raw.range.start, raw.range['end']
      item.start_row, item.end_row = s.line, e.line
      item.start_col = util.byte_col(bufnr, s.line, s.character, client.offset_encoding)
      item.end_col = util.byte_col(bufnr, e.line, e.character, client.offset_encoding)
    end
    items[#items + 1] = item
  end
  return items
end

--- Asks for suggestions at the cursor now.
---@param bufnr integer
---@param trigger integer 1 invoked, 2 automatic
function M.request(bufnr, trigger)
  local state = buffers[bufnr]
  local client = state and vim.lsp.get_client_by_id(state.client_id)
  if not state or not state.enabled or not client then
    return
  end
  cancel(state)
  local tick = vim.api.nvim_buf_get_changedtick(bufnr)
  local win = vim.fn.bufwinid(bufnr)
  local cursor = vim.api.nvim_win_get_cursor(win)
  local params = vim.lsp.util.make_position_params(win, client.offset_encoding)
  params.context = { triggerKind = trigger }
  local _, request_id = util.request(client, 'textDocument/inlineCompletion', params, function(err, result)
    if buffers[bufnr] ~= state then
      return
    end
    state.request_id = nil
    local moved = vim.api.nvim_buf_get_changedtick(bufnr) ~= tick
      or not vim.deep_equal(vim.api.nvim_win_get_cursor(win), cursor)
    if err or moved then
      return
    end
    state.items, state.index = normalize(bufnr, client, result), 1
    render(bufnr)
  end, bufnr)
  state.request_id = request_id
end

--- The suggestion shown grew on the server: ask again, at once (served from specd-lsp's cache).
---@param bufnr integer
function M.regrow(bufnr)
  M.request(bufnr, TRIGGER_AUTOMATIC)
end

---@param bufnr integer
local function schedule_request(bufnr)
  local state = buffers[bufnr]
  if not state or not state.enabled then
    return
  end
  cancel(state)
  state.items = {}
  M.hide(bufnr)
  state.timer = vim.uv.new_timer()
  state.timer:start(debounce_ms, 0, vim.schedule_wrap(function()
    if buffers[bufnr] == state and state.timer then
      state.timer:close()
      state.timer = nil
      M.request(bufnr, TRIGGER_AUTOMATIC)
    end
  end))
end

---@param client vim.lsp.Client
---@param bufnr integer
---@param enabled boolean
function M.attach(client, bufnr, enabled)
  if buffers[bufnr] then
    buffers[bufnr].client_id = client.id
    return
  end
  buffers[bufnr] = { client_id = client.id, items = {}, index = 1, enabled = enabled }
  local group = vim.api.nvim_create_augroup('specd.ghost.' .. bufnr, { clear = true })
  vim.api.nvim_create_autocmd({ 'InsertEnter', 'TextChangedI', 'CursorMovedI' }, {
    group = group,
    buffer = bufnr,
    callback = function()
      schedule_request(bufnr)
    end,
  })
  vim.api.nvim_create_autocmd({ 'InsertLeave', 'BufLeave' }, {
    group = group,
    buffer = bufnr,
    callback = function()
      M.dismiss(bufnr)
    end,
  })
end

---@param bufnr integer
function M.detach(bufnr)
  local state = buffers[bufnr]
  if state then
    cancel(state)
    buffers[bufnr] = nil
    pcall(vim.api.nvim_del_augroup_by_name, 'specd.ghost.' .. bufnr)
    if vim.api.nvim_buf_is_valid(bufnr) then
      M.hide(bufnr)
    end
  end
end

---@param bufnr integer
---@param enabled boolean
function M.set_enabled(bufnr, enabled)
  local state = buffers[bufnr]
  if state then
    state.enabled = enabled
    if not enabled then
      M.dismiss(bufnr)
    end
  end
end

---@param bufnr integer
---@param kind 'all'|'line'|'word'
---@return boolean taken whether a suggestion was shown
function M.accept(bufnr, kind)
  local state = buffers[bufnr]
  local item = state and M.visible(bufnr) and state.items[state.index]
  if not item then
    return false
  end
  M.dismiss(bufnr)
  -- Scheduled: an <expr> mapping may not change the buffer.
  vim.schedule(function()
    accept.take(bufnr, item, kind)
  end)
  return true
end

--- Cycles through the alternatives; with only one, asks for alternatives (an invoked request).
---@param bufnr integer
---@param count integer
function M.select(bufnr, count)
  local state = buffers[bufnr]
  if not state then
    return
  end
  local n = #state.items
  if n <= 1 then
    M.request(bufnr, TRIGGER_INVOKED)
    return
  end
  state.index = (state.index - 1 + count) % n + 1
  render(bufnr)
end

---@param bufnr integer
---@return boolean whether a suggestion was shown
function M.dismiss(bufnr)
  local state = buffers[bufnr]
  local shown = M.visible(bufnr)
  if state then
    cancel(state)
    state.items = {}
  end
  M.hide(bufnr)
  return shown
end

return M
