--- Suggestion text and the buffer: what remains to be typed, the next line or word of it, and
--- inserting all or part of it. Shared by both renderers.

local util = require('specd.util')

local M = {}

---@class specd.Item
---@field text string The text that replaces [start, end)
---@field start_row integer 0-based
---@field start_col integer byte column
---@field end_row integer
---@field end_col integer
---@field command? lsp.Command Run after the whole item is inserted
---@field client_id integer

--- The part of the suggestion not yet in the buffer: the item's text minus what lies between
--- its start and the cursor. nil when the buffer no longer agrees with the item.
---@param item specd.Item
---@param bufnr integer
---@param row integer cursor row, 0-based
---@param col integer cursor byte column
---@return string?
function M.remaining(item, bufnr, row, col)
  if row ~= item.start_row or col < item.start_col then
    return nil
  end
  local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ''
  local typed = line:sub(item.start_col + 1, col)
  if item.text:sub(1, #typed) ~= typed then
    return nil
  end
  return item.text:sub(#typed + 1)
end

--- The next line of `rest`: up to its first line break; a leading break and the line after it.
---@param rest string
---@return string
function M.next_line(rest)
  if rest:sub(1, 1) == '\n' then
    return '\n' .. rest:sub(2):match('^[^\n]*')
  end
  return rest:match('^[^\n]*')
end

--- The next word of `rest`, with the whitespace before it: a run of word characters, or of
--- punctuation.
---@param rest string
---@return string
function M.next_word(rest)
  return rest:match('^%s*[%w_]+') or rest:match('^%s*[^%w_%s]+') or rest
end

---@param bufnr integer
---@param row integer
---@param col integer
---@param lines string[]
local function place_cursor(bufnr, row, col, lines)
  local win = vim.fn.bufwinid(bufnr)
  if win ~= -1 then
    vim.api.nvim_win_set_cursor(win, { row + #lines, (#lines == 1 and col or 0) + #lines[#lines] })
  end
end

--- Inserts the whole item, or its next line or word. A part is typed in at the cursor (the rest
--- of the line stays); the whole item replaces its range. Returns true when the whole item went in
--- (the caller then runs the item's command), else false and the part inserted.
---@param bufnr integer
---@param item specd.Item
---@param kind 'all'|'line'|'word'
---@return boolean whole, string? piece
function M.apply(bufnr, item, kind)
  if kind ~= 'all' then
    local row, col = util.cursor(bufnr)
    local rest = M.remaining(item, bufnr, row, col)
    if rest then
      local piece = kind == 'line' and M.next_line(rest) or M.next_word(rest)
      if piece ~= rest then
        local lines = vim.split(piece, '\n', { plain = true })
        vim.api.nvim_buf_set_text(bufnr, row, col, row, col, lines)
        place_cursor(bufnr, row, col, lines)
        return false, piece
      end
    end
  end
  local lines = vim.split(item.text, '\n', { plain = true })
  vim.api.nvim_buf_set_text(bufnr, item.start_row, item.start_col, item.end_row, item.end_col, lines)
  place_cursor(bufnr, item.start_row, item.start_col, lines)
  return true, nil
end

return M
