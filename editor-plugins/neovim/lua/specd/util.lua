--- Calls whose shape changed between Neovim 0.10 and 0.12, in one place.

local M = {}

local HAS_011 = vim.fn.has('nvim-0.11') == 1

M.NAME = 'specd' -- the LSP client's name

--- specd clients, optionally only those attached to `bufnr`.
---@param bufnr? integer
---@return vim.lsp.Client[]
function M.clients(bufnr)
  return vim.lsp.get_clients({ name = M.NAME, bufnr = bufnr })
end

---@param client vim.lsp.Client
---@return boolean, integer?
function M.request(client, method, params, handler, bufnr)
  if HAS_011 then
    return client:request(method, params, handler, bufnr)
  end
  return client.request(method, params, handler, bufnr)
end

---@param client vim.lsp.Client
---@param method string
---@param params table
---@return boolean
function M.notify(client, method, params)
  if HAS_011 then
    return client:notify(method, params)
  end
  return client.notify(method, params)
end

---@param client vim.lsp.Client
---@param request_id integer
function M.cancel(client, request_id)
  if HAS_011 then
    client:cancel_request(request_id)
  else
    client.cancel_request(request_id)
  end
end

--- Runs an item's command on the server (specd-lsp counts the accept and prefetches).
---@param client vim.lsp.Client
---@param command lsp.Command
---@param bufnr integer
function M.exec_cmd(client, command, bufnr)
  if HAS_011 then
    client:exec_cmd(command, { bufnr = bufnr })
  else
    client.request('workspace/executeCommand', command, function() end, bufnr)
  end
end

---@param client vim.lsp.Client
function M.stop(client)
  if HAS_011 then
    client:stop()
  else
    client.stop()
  end
end

---@param client vim.lsp.Client
---@return boolean
function M.is_stopped(client)
  if HAS_011 then
    return client:is_stopped()
  end
  return client.is_stopped()
end

--- Byte column of an LSP `character` on buffer line `row` (0-based), in the client's encoding.
---@param bufnr integer
---@param row integer
---@param character integer
---@param encoding string 'utf-8'|'utf-16'|'utf-32'
---@return integer
function M.byte_col(bufnr, row, character, encoding)
  local line = vim.api.nvim_buf_get_lines(bufnr, row, row + 1, false)[1] or ''
  if encoding == 'utf-8' then
    return math.min(character, #line)
  end
  local ok, col
  if HAS_011 then
    ok, col = pcall(vim.str_byteindex, line, encoding, character, false)
  else
    ok, col = pcall(vim.str_byteindex, line, character, encoding == 'utf-16')
  end
  return ok and col or #line
end

--- The 0-based (row, byte column) of the cursor in the window showing `bufnr`.
---@param bufnr integer
---@return integer row, integer col
function M.cursor(bufnr)
  local win = vim.fn.bufwinid(bufnr)
  local pos = vim.api.nvim_win_get_cursor(win ~= -1 and win or 0)
  return pos[1] - 1, pos[2]
end

---@param mode string
---@return boolean
function M.in_insert_mode(mode)
  return mode:sub(1, 1) == 'i'
end

return M
